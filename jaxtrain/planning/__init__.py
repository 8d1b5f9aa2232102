"""`jaxtrain plan`: a run's own train step compiled for a cluster it does not have, and read.

  hlo.py           the collectives of an optimized HLO module (kind, bytes, groups, trip counts)
  hlo_costs.py     its matmul FLOPs and memory traffic, loops counted
  program.py       compile the Trainer's train step from shapes alone on N (virtual) devices and
                   read memory, FLOPs and collectives from the executable; big models compile a
                   repeating unit of layers twice and three times and are scaled to their depth
  accelerators.py  the spec table (peak FLOP/s, HBM, link bandwidths) with its sources
  roofline.py      compute, memory and communication time; predicted step time, MFU, fit
  report.py        the printed table and plan.json

`jaxtrain.cli.plan` runs it: the compile happens in a child process that has the device count.
"""
