#!/bin/bash
# alt.sh N: N alternations of the tree before and after (files swapped in /work/main)
for i in $(seq 1 $1); do
  for t in after before; do
    cp -r /tmp/fl/tree_$t/engine /work/main/
    /tmp/fl/run.sh ${t}_$i
  done
done
cp -r /tmp/fl/tree_after/engine /work/main/
