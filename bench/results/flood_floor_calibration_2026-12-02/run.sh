#!/bin/bash
# run.sh NAME [env...]: one fleet flood
name=$1; shift
ray stop --force >/dev/null 2>&1
env "$@" timeout 900 sloserve bench flood --replicas 3 --on-doomed reject --output-dir /tmp/fl/runs/$name > /tmp/fl/runs/$name.log 2>&1
echo "$name $(grep -E '^urgent accepted' /tmp/fl/runs/$name.log | cut -c32-) | $(grep -E 'outside the server' /tmp/fl/runs/$name.log | cut -c32-60)"
