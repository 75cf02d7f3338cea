#!/bin/sh
# Start the kernel NFS server (NFSv4 only) exporting $EXPORT_DIR, then wait; on SIGTERM stop
# serving cleanly so clients see a server shutdown, not a vanished peer.
set -eu

EXPORT_DIR="${EXPORT_DIR:-/exports}"
THREADS="${NFS_THREADS:-16}"
# Read-only to every client: the DataStage copy Job writes the disk itself (it mounts the
# server's claim on this node), so no NFS client can change the data. fsid=0 makes the directory
# the NFSv4 pseudo-root (clients mount "<server>:/"); root is squashed; no "insecure": clients
# must use privileged source ports, as kubelets' kernel mounts do. The operator sets the same
# options (render/datastage.py EXPORT_OPTIONS).
OPTIONS="${EXPORT_OPTIONS:-ro,fsid=0,sync,no_subtree_check,root_squash}"

mkdir -p "$EXPORT_DIR"
# The DataStage copy Job writes the disk as a non-root user (the operator sets EXPORT_OWNER to its
# uid:gid); readers get the files through their default 0644/0755 modes.
if [ -n "${EXPORT_OWNER:-}" ]; then
    chown "$EXPORT_OWNER" "$EXPORT_DIR"
fi
echo "$EXPORT_DIR *($OPTIONS)" > /etc/exports

mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd

stop() {
    echo "nfs-server: stopping"
    rpc.nfsd 0 || true
    exportfs -uav || true
    kill "$mountd_pid" 2>/dev/null || true
    exit 0
}
trap stop TERM INT

exportfs -rv
# -N 2 -N 3: NFSv4 only, so neither rpcbind nor statd is needed.
rpc.mountd -N 2 -N 3 -V 4 --foreground &
mountd_pid=$!
rpc.nfsd -N 2 -N 3 -V 4 "$THREADS"
echo "nfs-server: exporting $EXPORT_DIR on 2049/tcp with $THREADS threads"

# `wait` returns when a trapped signal arrives, so the trap runs promptly.
while kill -0 "$mountd_pid" 2>/dev/null; do
    wait "$mountd_pid" || true
done
echo "nfs-server: rpc.mountd exited" >&2
exit 1
