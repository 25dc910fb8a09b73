"""The parts of tools/calibrate_planner.py: ``runs`` (the measured runs), ``quiet`` (waiting for an
idle machine), ``machine`` (the machine figures), ``prediction`` (the planner's prediction of a run and
the one fitted figure) and ``table`` (predicted vs measured)."""
