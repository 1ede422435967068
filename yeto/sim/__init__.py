"""A DiLoCo fleet in one process (`python -m yeto.sim`): the syncer's service and k
islands over an in-process transport (`yeto.sim.transport`), for runs of hundreds of
rounds on one machine. See `yeto.sim.fleet`."""
