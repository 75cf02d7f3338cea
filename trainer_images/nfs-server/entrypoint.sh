#!/bin/sh
# Serve $EXPORT_DIR read-only over NFSv4 with NFS-Ganesha (VFS FSAL) to the clients listed in
# $CLIENTS_FILE, and follow that list: the operator keeps it in an annotation of this pod (the
# DataStage's readers and datastage.nfsClientCIDRs: render/datastage.py export_clients), the
# kubelet writes it into the file (downward API), and on a change this script rewrites the
# export and sends Ganesha SIGHUP, on which it rereads its exports. SIGTERM is passed to ganesha.nfsd, which stops cleanly
# (unregisters, closes its connections and exits 0); this script then exits with its status.
#
# Privileges: none but CAP_DAC_READ_SEARCH, as uid 10002. The VFS FSAL turns NFS file handles
# into open files with open_by_handle_at(2), which the kernel allows only to a process holding
# CAP_DAC_READ_SEARCH in the initial user namespace (since Linux 6.10 a user namespace may open
# directories by handle, never files). Without it every request fails with NFS4ERR_PERM (tried
# here, 2026-11-27). The same syscall is why the pod's seccomp profile is not containerd's
# RuntimeDefault, which refuses it (render/datastage.py DEFAULTS). Ganesha needs no other: as
# non-root it cannot and need not switch to a client's uid, because the export is read-only and
# every client's identity is squashed (below), and nothing here binds a port under 1024.
set -euf  # -f: no globbing of the list's entries

EXPORT_DIR="${EXPORT_DIR:-/exports}"
RUN_DIR="${RUN_DIR:-/run/ganesha}"        # writable (an emptyDir): config, pid, recovery
CLIENTS_FILE="${CLIENTS_FILE:-/etc/trainop/nfs-clients/clients}"  # addresses/CIDRs, comma-separated
MINOR_VERSIONS="${NFS_MINOR_VERSIONS:-0, 1}"
GANESHA="${GANESHA:-/usr/bin/ganesha.nfsd}"
POLL_SECONDS="${POLL_SECONDS:-1}"
mkdir -p "$RUN_DIR/recovery"

# The list, comma-separated ("" when the file is empty or absent: nobody may mount yet). Only
# entries made of address characters (IPv4 or IPv6, with an optional /prefix) get into Ganesha's
# configuration; anything else is left out with a line on stderr, because the file is an
# annotation of a pod in the tenant's namespace and its text would otherwise be configuration
# syntax.
clients() {
    list=""
    [ -r "$CLIENTS_FILE" ] || return 0
    for entry in $(tr ',' ' ' < "$CLIENTS_FILE"); do
        case "$entry" in
            *[!0-9A-Fa-f:./]*) echo "nfs-server: client entry '$entry' left out: not an address or CIDR" >&2 ;;
            *.*.*.*|*:*) list="${list:+$list, }$entry" ;;
            *) echo "nfs-server: client entry '$entry' left out: not an address or CIDR" >&2 ;;
        esac
    done
    printf '%s' "$list"
}

# NFSv4 only (4.1 for kubelets' mounts, which the PV pins; 4.0 for libnfs, the user-space client
# of the tests and the bench, which speaks no 4.1). Graceless: the export is read-only, so there
# are no locks or delegations to reclaim and a restarted server serves at once.
# The export: read-only to the listed clients, nothing to anyone else (Access_Type = None);
# root squashed to the anonymous uid; AUTH_SYS only; numeric owners (no idmapd). The copy Job
# writes the disk itself, never over NFS.
write_config() {
    list=$(clients)
    if [ -n "$list" ]; then
        client_block="CLIENT { Clients = $list; Access_Type = RO; }"
    else
        client_block="# no client listed: nobody may mount"
    fi

cat > "$RUN_DIR/ganesha.conf.new" <<CONF
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
    $client_block
}
LOG {
    Default_Log_Level = EVENT;
    # D-Bus (the admin interface) and Kerberos are absent by design: not errors worth a line.
    Components { DBUS = FATAL; NFS_CB = MAJ; }
}
CONF
    mv "$RUN_DIR/ganesha.conf.new" "$RUN_DIR/ganesha.conf"
    echo "nfs-server: exporting $EXPORT_DIR read-only to: ${list:-nobody}"
}

stopping="" server=""
trap 'stopping=1; [ -z "$server" ] || kill -TERM "$server" 2>/dev/null' TERM INT
write_config
echo "nfs-server: NFS-Ganesha on 2049/tcp (NFSv4 minor $MINOR_VERSIONS)"
grep '^Cap' /proc/self/status >&2 || true
"$GANESHA" -F -L STDERR -p "$RUN_DIR/ganesha.pid" -f "$RUN_DIR/ganesha.conf" &
server=$!
[ -z "$stopping" ] || kill -TERM "$server"  # a SIGTERM before it started

# The kubelet swaps the downward API's files atomically (a symlink): compare the list every
# POLL_SECONDS (inotify-tools would be a package more for a file of a few lines) and, when it
# changed, rewrite the export and send SIGHUP. Ganesha then rereads its exports ("Reread
# exports" in its log) and judges the next request, on open connections too, by the new list.
# The watcher starts from the list write_config served ($list, not the file read again): a change
# that came before the watcher's first look is then a change too (under load, the tests saw one
# lost that way).
(
    seen=$list
    while sleep "$POLL_SECONDS"; do
        [ "$(clients 2>/dev/null)" = "$seen" ] && continue
        write_config
        kill -HUP "$server" 2>/dev/null || exit 0
        seen=$list
    done
) &
watcher=$!

rc=0
wait "$server" || rc=$?
if [ -n "$stopping" ] && [ "$rc" -gt 128 ]; then  # the trap cut the wait short: Ganesha's own
    rc=0                                          # status once it is done
    wait "$server" || rc=$?
fi
kill "$watcher" 2>/dev/null || true
echo "nfs-server: ganesha.nfsd exited with status $rc"
exit "$rc"
