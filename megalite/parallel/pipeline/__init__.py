"""Pipeline parallelism: schedules as action lists, the global posting order, one executor, stages."""
