#!/bin/bash
# abcaps.sh PREFIX N: alternate the deadline caps after/before the free-tokens change
cd /work/main
for i in $(seq 1 $2); do
  cp /tmp/fl/caps_after.py engine/core/deadline_caps.py; bash /tmp/fl/run.sh ${1}after_$i
  cp /tmp/fl/caps_before.py engine/core/deadline_caps.py; bash /tmp/fl/run.sh ${1}before_$i
done
cp /tmp/fl/caps_after.py engine/core/deadline_caps.py
