"""What a rank checks beside the timings, and the findings it raises while training runs.

Here: ``attached`` (the checks of one attached DDP instance, started and stopped together),
``sampled`` (``SampledChecks``: requires_grad at every forward, the sampled steps'
gradient arrivals, unused parameters and fingerprints), ``fingerprints``, ``used_map`` (DDP's
map of the parameters a step used), ``nonfinite`` (a rank's own non-finite gradients before the
all-reduce), ``unsynced`` (weights updated after a backward DDP did not all-reduce), ``replicas``
(``check_replicas``: the ranks' weights compared), ``live_findings`` (the findings raised as
warnings during the run).

Not here: when the checks run (``runtime.step.hooks`` calls them from the forward), what the
findings mean (``ddpdoctor.analysis``, which reads the same records after the run).
"""
