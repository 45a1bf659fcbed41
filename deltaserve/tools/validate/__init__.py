"""The gate: replay the same trace on the real engine and in the simulator, and compare, in three parts.

    deltaserve simulate validate --out DIR [--presets tiny,qwen3.5-0.8b-shape] [--loads light,saturated,overloaded]
                                 [--caching on,off] [--clocks cpu,wall] [--reprofile] [--quick]

For each preset: profile the engine on this machine into DIR/bundles/PRESET (unless a bundle is there), make an
agent-session trace, and pick three arrival-time scales for it from the simulator's own estimate of the
engine's capacity (light: ~30% busy; saturated: ~90% busy; overloaded: arrivals about twice as fast as the
engine can serve). Each (load, caching, clock) scenario replays the trace on a fresh real LLMEngine TWICE (a few
warm-up requests under their own cache salt, then the trace offline: each request added once its arrival time
has passed on the replay's clock, engine.step() in a loop for as long as there are requests or background jobs,
as a server steps; cpu clock: the engine thread's CPU time, idle gaps skipped; wall), each run followed by its
simulations, and reports:

  a. scheduling fidelity, exact: the simulator on each real run's own measured step durations (sim/replayed.py:
     the k-th step takes the k-th measured duration, so the simulated clock is the real one) must take the very
     same steps: the same requests and token counts in every step, the same cached tokens per request, the same
     preemptions. A difference is a bug in the code the engine and the simulator share, not noise.
  b. the latency model, per step: predicted (at the probe's speed: nothing of the replay went into it) against
     measured duration of every real step, median and p90 |error| by step kind.
  c. end to end, against the engine's own spread: TTFT mean / p90, TPOT and E2E of the simulation at the probed
     speed against each real run, beside run 2 against run 1. A metric passes when the simulator is within its
     bar (5%, 5%, 2%, 3%) or within the real engine's own run-to-run difference, whichever is larger.

The command exits 1 when any run fails part a (that is a bug to find); parts b and c are measurements to read.

The machine is shared and its speed drifts by several percent within a minute, and the bundle's tables were
measured at another moment. So part c simulates at the speed a probe measured while the replay ran, and the
probe uses nothing from the replay:

  interleaved  (the default) a twin engine, same flags, replays another trace from the same generator at the
               same load (seed + 1: the same kind of steps, none of the same requests) in bursts between the
               replay's steps, half the replay's CPU time; the replay's clock stops during a burst, and a
               burst's short first step (on the caches the replay left) is not a sample. Its
               measured / predicted time, pooled over 32 neighbouring steps of a kind, is the speed at each
               moment for steps with prompt tokens and for decode-only steps apart (StepSpeed; on a shared
               machine the two drift apart), so the simulator follows the drift over the replay.
  bracket      the warm-up requests' steps before the replay and the same requests again after it: one factor.
  before       the warm-up steps alone.

Also simulated, for diagnosis: `static` (the bundle as profiled) and `oracle` (the replay's own measured /
predicted step time, by step kind as the probe reads it). DIR/steps-*.json keeps every step of each replay and
of its probe, measured and predicted, and the replay's schedule (what each step did, on the replay's clock).

Modules, along the gate's phases: scenarios.py (the workloads and their loads), real.py (the real engine's
replay and the probe), simulate.py (the simulator's replica on the same flags), speed.py (the machine's speed
against the bundle), compare.py (the three parts), replay.py (one real replay and everything simulated from it),
report.py (the tables), cli.py (the command).
"""
