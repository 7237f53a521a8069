"""Calibration: kernel, link and schedule rates measured on this cluster (engine runs, the collective sweep) fitted into the simulator's terms.

May import tuning.sim, engine/ and profilers/."""
