"""Campaign: every stage for every recipe, then the comparison (``make all``); its files
(``configs/campaigns/``), its settings, one runner and its executors (this machine, Ray)."""

from pipeline.campaign.runner import CampaignIncomplete, Stages, run, stages
from pipeline.campaign.settings import CampaignSettings

__all__ = ["CampaignIncomplete", "CampaignSettings", "Stages", "run", "stages"]
