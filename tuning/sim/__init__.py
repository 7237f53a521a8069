"""The simulator: cost modules (compute, kernels, tensor / pipeline / ZeRO / context / MoE communication, memory, schedules), one core composing them, hardware presets, the published runs and memory facts it is validated on (leave one source out).

Owns the cost model's facts; may import engine/ and profilers/ (shapes, formulas, bandwidth math) and tuning.calibrate only through the fitted terms it is given; nothing here starts a process."""
