"""The federated math of a job, shared by the site and `muninn-worker simulate`: pure functions over plain values
and tensors, no Django and no I/O.

  aggregation   FedAvg (weighted by samples) and DiLoCo's outer Nesterov step
  robust        the per-job rules for rounds with malicious devices (trimmed mean, median, norm clipping)
  algorithms    the customer's training scheme (fedavg / diloco, update encoding) and the next global weights
  sharding      shard sizes ∝ each device's throughput
  plan          what a job's rounds are made of: the held-out split, the initial weights, unit seeds, the
                arguments of each unit's training, the round's rule
  partition     label-skewed (non-IID) partitions, for simulations only: the site never partitions by label

The site (jobs/) imports these, so a simulation that calls them does what a real job does.
"""
