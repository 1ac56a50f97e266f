#!/bin/bash
# ab.sh N: one fleet; floods alternately at Ray's direct ingress (8000) and the ingress's own server (8123)
ray stop --force >/dev/null 2>&1
mkdir -p /tmp/fl/model && python -c "
from pathlib import Path
from engine.benchmarks.attainment.cli import _simulated_model
print(_simulated_model('h100-llama-3.1-8b', Path('/tmp/fl/model')))" > /tmp/fl/model.txt
M=$(tail -1 /tmp/fl/model.txt)
OWN_HTTP_PORT=8123 sloserve serve --model $M --max-num-queued-reqs 8 --on-doomed reject --simulate h100-llama-3.1-8b --max-model-len 32768 --replicas 3 --port 8000 > /tmp/fl/fleet.log 2>&1 &
until curl -s localhost:8000/health | grep -q '"ok"'; do sleep 1; done
curl -s localhost:8123/health; echo
for i in $(seq 1 $1); do
  for p in 8000 8123; do
    sloserve bench flood --url http://127.0.0.1:$p --queue-bound 8 --replicas 3 --on-doomed reject --simulate h100-llama-3.1-8b --model $M --output-dir /tmp/fl/runs/ab_${p}_$i > /tmp/fl/runs/ab_${p}_$i.log 2>&1
    echo "ab_${p}_$i $(grep -E '^urgent accepted' /tmp/fl/runs/ab_${p}_$i.log | cut -c32-) | $(grep -E 'outside the server' /tmp/fl/runs/ab_${p}_$i.log | cut -c32-60)"
    sleep 3
  done
done
kill %1; wait
