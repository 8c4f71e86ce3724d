"""`autopar simulate`: a plan's ranks built and stepped on fake tensors over a fake process group,
with no devices: each rank's peak memory and every collective it issues (rank.py), against what
the plan predicted (report.py)."""

from autopar.simulate.rank import RankRun, simulate_rank, simulate_ranks
from autopar.simulate.report import (RankReport, SimulatedPrices, priced_as_simulated, rank_report,
                                     ranks_to_simulate)

__all__ = ["RankRun", "RankReport", "SimulatedPrices", "priced_as_simulated", "rank_report",
           "ranks_to_simulate", "simulate_rank", "simulate_ranks"]
