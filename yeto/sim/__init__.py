"""A DiLoCo fleet in one process (`python -m yeto.sim`): the syncer's service and k
islands over an in-process transport (`yeto.sim.transport`), for runs of hundreds of
rounds on one machine. See `yeto.sim.fleet`.

- `fleet`: `run_fleet`, the syncer and k real islands, each in its own thread;
- `transport`: the real gRPC client code over the real syncer service, without sockets;
- `clock`: simulated time (`--step-seconds`), each island on its own clock;
- `scale`: the fleet-scale model (`--islands 1000 --shards ...`): a model, not a run;
- `diloco_model`: its DiLoCo arm, k islands pushing fragments to S shards;
- `sync_model`: its synchronous data-parallel arm, an all-reduce every step;
- `trace`: its fleet and the seeded failures both arms meet.
"""
