"""Sample every process's CPU ticks every 10 ms; write (t, pid, name, utime+stime) lines."""
import os, sys, time
out = open(sys.argv[1], "w")
names = {}
def name(pid):
    if pid not in names:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            cmd = "?"
        names[pid] = cmd
    return names[pid]
end = time.time() + float(sys.argv[2])
n = 0
while time.time() < end:
    n += 1
    if n % 20 == 0: names.clear()
    t = time.time()
    rows = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            f = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        rest = f.rsplit(")", 1)[1].split()
        ticks = int(rest[11]) + int(rest[12])
        rows.append(f"{t:.3f}\t{p}\t{ticks}\t{name(int(p))}")
    out.write("\n".join(rows) + "\n")
    time.sleep(float(sys.argv[3]) if len(sys.argv)>3 else 0.1)
out.close()
