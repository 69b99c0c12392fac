"""How a run spans processes: device and seeds, DDP / FSDP2 / DeepSpeed engines, collectives, OOM agreement,
stopping every process together, optimizer-state parking, memory readings, Ulysses sequence parallelism."""
