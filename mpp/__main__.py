"""`python -m mpp ...` is the `mpp` console script."""

from mpp.commands import main

main()
