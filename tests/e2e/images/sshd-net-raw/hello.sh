#!/bin/sh
# What a pod of this image says: where it runs, as whom, on which Debian.
. /etc/os-release
echo "hello from $(hostname) as uid $(id -u) on Debian $VERSION_CODENAME"
