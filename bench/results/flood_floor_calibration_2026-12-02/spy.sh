#!/bin/bash
# spy.sh NAME PATTERN: run the fleet flood, py-spy the process matching PATTERN from the flood's start for 5 s
name=$1; pat=${2:-SloserveIngress}
ray stop --force >/dev/null 2>&1; rm -f /tmp/fl/mark
(FLOOD_MARK=/tmp/fl/mark timeout 900 sloserve bench flood --replicas 3 --on-doomed reject --output-dir /tmp/fl/runs/$name > /tmp/fl/runs/$name.log 2>&1; echo rc=$? >> /tmp/fl/$name.log) &
until [ -e /tmp/fl/mark ]; do sleep 0.05; done
pid=$(ps -eo pid,args | grep "$pat" | grep -v grep | head -1 | awk '{print $1}'); echo pid=$pid
py-spy record -p $pid --nonblocking -r 250 ${SPYARGS:--f raw} -o /tmp/fl/$name.spy -d 5 > /tmp/fl/$name.spylog 2>&1
wait
grep -E "urgent acc|result" /tmp/fl/runs/$name.log
