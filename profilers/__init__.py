"""Profilers, telemetry and the run store (imports nothing from engine/tuning/workbench).

Modules, one concept each: `records` (the Record format), `store` (RunStore, SQLite WAL),
`telemetry` (TelemetryServer / TelemetryClient), `steps` (StepTimer), `collectives`
(CollectiveProfiler, busbw math, commbench), `nvml`, `host`, `memory` (samplers),
`trace` (TraceWindow), `base` (the Sampler contract). Import them directly: this package
imports nothing eagerly, so reading the store does not pull in torch.
"""
