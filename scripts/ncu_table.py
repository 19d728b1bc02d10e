#!/usr/bin/env python3
"""Prints ncu --csv output (gpu__time_duration.sum, dram__bytes_read.sum) as a per-kernel table:
time, DRAM bytes read and achieved read bandwidth, skipping the synthetic-weight kernels.
--summary: one row per kernel name instead (launches, total time and its share, bytes, GB/s),
slowest first. --metrics: each kernel's other metrics too, one line each after its row."""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1])))
header = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
h = rows[header]
name_i, metric_i, value_i, id_i = (h.index(c) for c in ('Kernel Name', 'Metric Name', 'Metric Value', 'ID'))
kernels = collections.OrderedDict()
for r in rows[header + 1:]:
    if len(r) < len(h):
        continue
    kernels.setdefault(int(r[id_i]), {'name': r[name_i]})[r[metric_i]] = float(r[value_i].replace(',', ''))
summary = '--summary' in sys.argv[2:]
by_name = collections.OrderedDict()
total_us = total_mb = 0.0
for i, k in kernels.items():
    if 'Synthetic' in k['name']:
        continue
    t_ns, b = k.get('gpu__time_duration.sum', 0.0), k.get('dram__bytes_read.sum', 0.0)
    total_us += t_ns / 1e3
    total_mb += b / 1e6
    if summary:
        entry = by_name.setdefault(k['name'][:90], [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += t_ns / 1e3
        entry[2] += b / 1e6
        continue
    print(f"{i:5d} {t_ns / 1e3:9.2f} us {b / 1e6:9.3f} MB {b / max(t_ns, 1):8.1f} GB/s  {k['name'][:80]}")
    if '--metrics' in sys.argv[2:]:
        print('        ' + '  '.join(f"{m} {v:g}" for m, v in k.items()
                                      if m not in ('name', 'gpu__time_duration.sum', 'dram__bytes_read.sum')))
for name, (n, us, mb) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
    print(f"{n:5d}x {us:10.1f} us {100 * us / max(total_us, 1e-9):5.1f} % {mb:10.1f} MB "
          f"{mb * 1e3 / max(us, 1e-9):8.1f} GB/s  {name}")
print(f"total {total_us:.1f} us, {total_mb:.1f} MB read")
