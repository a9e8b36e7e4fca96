"""How often each verdict is wrong: scenarios with a known truth through the verdicts' own code."""
