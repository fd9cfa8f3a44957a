"""Many models under one memory budget: CoServe's scheduler (sched), the pool's configuration (spec),
a simulator of it (sim), the executors that load and run the models (executor) and the
OpenAI-compatible server in front of them (http)."""
