import collections, sys
tot = 0; by_fn = collections.Counter(); thread = collections.Counter(); leaf = collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    tot += n
    thread[frames[0][:60]] += n
    leaf[frames[-1][:120]] += n
    for f in set(frames):
        by_fn[f] += n
print("total samples", tot)
for t, n in thread.most_common(8): print(n, t)
print()
for f, n in by_fn.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 60): print(f"{n:5d} {f[:160]}")
print("\nleaves")
for f, n in leaf.most_common(25): print(f"{n:5d} {f[:160]}")
