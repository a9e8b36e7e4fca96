"""Campaign: every stage for every recipe, then the comparison (``make all``); its files
(``configs/campaigns/``), its settings, one runner and its executors (this machine, Ray).
Nothing is imported here, so that a Ray worker running a task's commands loads only the Ray
executor, not every stage."""
