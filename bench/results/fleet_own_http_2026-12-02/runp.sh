#!/bin/bash
# runp.sh NAME [serve flags...]: one fleet flood, the flags passed to sloserve serve
name=$1; shift
ray stop --force >/dev/null 2>&1
timeout 900 sloserve bench flood --replicas 3 --on-doomed reject --output-dir /tmp/fl/runs/$name -- "$@" > /tmp/fl/runs/$name.log 2>&1
echo "$name $(grep -E '^urgent accepted' /tmp/fl/runs/$name.log | cut -c32- | sed 's/; objectives.*//') | $(grep -E 'outside the server' /tmp/fl/runs/$name.log | cut -c32-60)"
