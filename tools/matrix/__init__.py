"""The compatibility matrix (docs/compatibility.md): every engine feature, every pair and the common
triples, each with a derived verdict and, for an accepted cell, a recorded run's evidence.

Owns: the matrix as data and each cell's verdict and run plan (compat.py), the code each cell runs and
its hash (compat_code.py), the recorded results and their staleness by that hash, CI's rotating sample
(compat_results.py), and the rendered document
(compat_doc.py); `python -m tools.matrix --write docs/compatibility.md` renders it. The cells
themselves run through tests/matrix_runner.py (`make matrix`). May import everything of ours;
nothing in the product imports it.
"""
