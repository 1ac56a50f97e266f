#!/bin/bash
# start a fleet, profile its ingress during one flood
set -u
OUT=$1; PORT=18777; mkdir -p $OUT
ray stop --force >/dev/null 2>&1
PYTHONUNBUFFERED=1 sloserve serve --host 127.0.0.1 --port $PORT --model /tmp/flmodel/model-llama-3.1-8b --max-num-queued-reqs 8 --on-doomed reject --simulate h100-llama-3.1-8b --max-model-len 32768 --replicas 3 > $OUT/server.log 2>&1 &
SPID=$!
for i in $(seq 1 300); do curl -s 127.0.0.1:$PORT/health 2>/dev/null | grep -q '"status": "ok"' && break; sleep 1; done
echo "ready after $i s"
sleep 3
P=$(pgrep -f "SloserveIngress" | head -1)
py-spy record -p $P -r 500 --threads -f raw -o $OUT/ingress.raw -d 25 --nonblocking > $OUT/pyspy.log 2>&1 &
sleep 1
PYTHONUNBUFFERED=1 sloserve bench flood --url http://127.0.0.1:$PORT --queue-bound 8 --on-doomed reject --output-dir $OUT/flood > $OUT/flood.out 2>&1
wait %2 2>/dev/null; sleep 5
kill -INT $SPID; sleep 8; ray stop --force >/dev/null 2>&1
grep "^urgent" $OUT/flood.out
