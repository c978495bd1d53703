"""The laboratory: studies of masked patch prediction, each a module run from the project's folder.

    python -m experiments.compare --out runs/demo         # make demo: pretrain, fine-tune, from scratch, one table
    python -m experiments.study --results results/study   # make study: arms x seeds x label budgets, error bars
    python -m experiments.levers                          # the levers that may move MPP ahead of scratch
    python -m experiments.leakage                         # does a hybrid's stem leak a [mask]ed token's colour?

The harness every study (the comparison of make demo among them) runs on, a concept to a file:

    settings.py  the arms, the ablation's objectives, the splits and a study's Settings
    plan.py      which jobs a study runs and in which order: choices on validation, then the test set
    runner.py    each job in a worker process and a folder of its own, resumable, as its plan says
    jobs.py      one job: an `mpp fit` / `mpp test` (quiet and CSV-logged, or as its config sets it up)
    reuse.py     what a study takes from work done: arms added, another study's runs, its numbers
    report.py    the audit of test-set reads, the study's numbers, its table and plots
    finals.py    a chosen point's numbers over its seeds, and the audit of a curve's or a screen's test reads
    stats.py     mean, std and Student's t intervals over seeds, paired differences

Nothing here is installed with mpp, and mpp imports none of it.
"""
