#!/bin/sh
# Serve $EXPORT_DIR read-only over NFSv4 with NFS-Ganesha (VFS FSAL) to the clients in
# $NFS_CLIENTS, in the foreground; `exec` so that SIGTERM reaches ganesha.nfsd itself, which
# stops cleanly (unregisters, closes its connections and exits 0).
#
# Privileges: none but CAP_DAC_READ_SEARCH, as uid 10002. The VFS FSAL turns NFS file handles
# into open files with open_by_handle_at(2), which the kernel allows only to a process holding
# CAP_DAC_READ_SEARCH in the initial user namespace (since Linux 6.10 a user namespace may open
# directories by handle, never files). Without it every request fails with NFS4ERR_PERM (tried
# here, 2026-11-27). The same syscall is why the pod's seccomp profile is not containerd's
# RuntimeDefault, which refuses it (render/datastage.py DEFAULTS). Ganesha needs no other: as
# non-root it cannot and need not switch to a client's uid, because the export is read-only and
# every client's identity is squashed (below), and nothing here binds a port under 1024.
set -eu

EXPORT_DIR="${EXPORT_DIR:-/exports}"
RUN_DIR="${RUN_DIR:-/run/ganesha}"        # writable (an emptyDir): config, pid, recovery
CLIENTS="${NFS_CLIENTS:-}"                # comma-separated IPs/CIDRs, from the operator
MINOR_VERSIONS="${NFS_MINOR_VERSIONS:-0, 1}"

if [ -z "$CLIENTS" ]; then
    echo "nfs-server: NFS_CLIENTS is empty: no client could mount; set datastage.nfsClientCIDRs" >&2
    exit 2
fi
mkdir -p "$RUN_DIR/recovery"

# NFSv4 only (4.1 for kubelets' mounts, which the PV pins; 4.0 for libnfs, the user-space client
# of the tests and the bench, which speaks no 4.1). Graceless: the export is read-only, so there
# are no locks or delegations to reclaim and a restarted server serves at once.
# The export: read-only to the listed clients, nothing to anyone else (Access_Type = None);
# root squashed to the anonymous uid; AUTH_SYS only; numeric owners (no idmapd). The copy Job
# writes the disk itself, never over NFS.
cat > "$RUN_DIR/ganesha.conf" <<CONF
NFS_CORE_PARAM {
    Protocols = 4;
    NFS_Port = 2049;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}
NFSV4 {
    Minor_Versions = $MINOR_VERSIONS;
    Graceless = true;
    RecoveryBackend = fs;
    RecoveryRoot = $RUN_DIR/recovery;
    Allow_Numeric_Owners = true;
    Only_Numeric_Owners = true;
}
NFS_KRB5 { Active_krb5 = false; }
EXPORT_DEFAULTS { Access_Type = None; }
EXPORT {
    Export_Id = 1;
    Path = $EXPORT_DIR;
    Pseudo = /;
    Protocols = 4;
    Transports = TCP;
    SecType = sys;
    Squash = root_squash;
    Access_Type = None;
    Disable_ACL = true;
    FSAL { Name = VFS; }
    CLIENT { Clients = $CLIENTS; Access_Type = RO; }
}
LOG {
    Default_Log_Level = EVENT;
    # D-Bus (the admin interface) and Kerberos are absent by design: not errors worth a line.
    Components { DBUS = FATAL; NFS_CB = MAJ; }
}
CONF

echo "nfs-server: NFS-Ganesha exporting $EXPORT_DIR read-only on 2049/tcp (NFSv4 minor $MINOR_VERSIONS) to $CLIENTS"
grep '^Cap' /proc/self/status >&2 || true
exec /usr/bin/ganesha.nfsd -F -L STDERR -p "$RUN_DIR/ganesha.pid" -f "$RUN_DIR/ganesha.conf"
