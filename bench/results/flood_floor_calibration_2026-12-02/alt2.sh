#!/bin/bash
# alt2.sh PREFIX N: N alternations of the tree before and after (engine/ swapped in /work/main; the
# monitor/ package is the same in both apart from docstrings)
for i in $(seq 1 $2); do
  for t in after before; do
    rm -rf /work/main/engine && cp -r /tmp/fl/tree_$t/engine /work/main/
    /tmp/fl/run.sh $1${t}_$i
  done
done
rm -rf /work/main/engine && cp -r /tmp/fl/tree_after/engine /work/main/
