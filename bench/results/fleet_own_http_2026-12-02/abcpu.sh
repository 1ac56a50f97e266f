#!/bin/bash
# abcpu.sh N: as ab.sh, recording the ingress process's CPU seconds per flood
ray stop --force >/dev/null 2>&1
M=$(tail -1 /tmp/fl/model.txt)
OWN_HTTP_PORT=8123 sloserve serve --model $M --max-num-queued-reqs 8 --on-doomed reject --simulate h100-llama-3.1-8b --max-model-len 32768 --replicas 3 --port 8000 > /tmp/fl/fleet.log 2>&1 &
until curl -s localhost:8000/health | grep -q '"ok"'; do sleep 1; done
ING=$(ps -eo pid,args | grep SloserveIngress | grep -v grep | awk '{print $1}')
cpu() { awk '{print $14+$15}' /proc/$ING/stat; }
for i in $(seq 1 $1); do
  for p in 8000 8123; do
    c0=$(cpu)
    sloserve bench flood --url http://127.0.0.1:$p --queue-bound 8 --replicas 3 --on-doomed reject --simulate h100-llama-3.1-8b --model $M --output-dir /tmp/fl/runs/abc_${p}_$i > /tmp/fl/runs/abc_${p}_$i.log 2>&1
    c1=$(cpu)
    echo "abc_${p}_$i ingress_ticks $((c1-c0)) $(grep -E '^urgent accepted' /tmp/fl/runs/abc_${p}_$i.log | cut -c32-90)"
    sleep 3
  done
done
kill %1; wait
