"""The machine room: what makes the product fast on a CPU, kept apart from the product.

- `process.py`: the process-wide settings made before torch loads (OpenMP spin, compile caches,
  huge pages), called explicitly by each entry point;
- `machine.py`: what this machine is (CPU name, flags, the tag of its compiled kernels);
- `cores.py`: how many CPUs this process may use, and the split between the serving engine and
  the trainer child;
- `lending.py`: the trainer's cores lent to the engine between steps and the engine's to a step
  between rounds (`CoreLease`, `SpareCores`);
- `pin.py`: a child process run on its own cores;
- `huge_pages.py`: transparent huge pages for a serving process's tensors.

A leaf: it imports nothing else of this project. The product rooms reach it through small hooks
that the entry points wire (`collab serve` splits, lends and pins; a trainer takes `TrainerHooks`;
the sandbox takes `set_max_concurrent`); `tasks/` and `trainer/` never import it.
docs/CPU.md explains the machinery once, with what it measured."""
