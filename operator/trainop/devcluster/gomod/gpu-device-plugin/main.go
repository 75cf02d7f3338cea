// gpu-device-plugin advertises a fixed number of devices of one extended resource (nvidia.com/gpu,
// rdma/ib) to a real kubelet through the kubelet's device-plugin API, as NVIDIA's and Mellanox's
// plugins do on AKS nodes. It is the dev cluster's stand-in for hardware this machine lacks: the
// devices are names only, and Allocate hands the container the same environment variable the real
// plugin sets (NVIDIA_VISIBLE_DEVICES), so scheduling, kubelet admission and device accounting are
// the real ones while the pod runs on the CPU.
//
// It registers through the kubelet's plugin watcher (a socket in <root-dir>/plugins_registry)
// rather than the fixed /var/lib/kubelet/device-plugins/kubelet.sock, because several kubelets
// share this host: the watcher folder is per kubelet root-dir, the registration socket is not.
// One socket serves both the Registration and the DevicePlugin services (Endpoint left empty).
//
// Written by hand because NVIDIA's plugin needs NVML (a GPU) to start; this is the smallest
// program that speaks the same v1beta1 API.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices  []*pluginapi.Device
	envName  string
	resource string
}

// registration answers the kubelet's plugin watcher.
type registration struct {
	registerapi.UnimplementedRegistrationServer
	resource string
}

func (r *registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{Type: registerapi.DevicePlugin, Name: r.resource,
		SupportedVersions: []string{pluginapi.Version}}, nil
}

func (r *registration) NotifyRegistrationStatus(_ context.Context, status *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !status.PluginRegistered {
		log.Printf("the kubelet refused %s: %s", r.resource, status.Error)
	} else {
		log.Printf("registered with the kubelet: %s", r.resource)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // devices never change: keep the stream open until the kubelet leaves
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		resp := &pluginapi.ContainerAllocateResponse{}
		if p.envName != "" {
			resp.Envs = map[string]string{p.envName: strings.Join(c.DevicesIds, ",")}
		}
		out.ContainerResponses = append(out.ContainerResponses, resp)
	}
	return out, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func main() {
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name to advertise")
	count := flag.Int("count", 1, "number of devices")
	dir := flag.String("dir", "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registration folder")
	envName := flag.String("env", "", "environment variable set to the allocated device IDs (e.g. NVIDIA_VISIBLE_DEVICES)")
	flag.Parse()

	prefix := strings.NewReplacer(".", "-", "/", "-").Replace(*resource)
	p := &plugin{envName: *envName, resource: *resource}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%s-%d", prefix, i), Health: pluginapi.Healthy})
	}
	socket := filepath.Join(*dir, "trainop-"+prefix+".sock")
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		log.Fatalf("listen on %s: %v", socket, err)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, p)
	registerapi.RegisterRegistrationServer(server, &registration{resource: *resource})
	log.Printf("serving %d x %s at %s", *count, *resource, socket)
	go func() { log.Fatal(server.Serve(listener)) }()

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	server.Stop()
	_ = os.Remove(socket)
}
