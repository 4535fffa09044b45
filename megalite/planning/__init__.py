"""The parallelism planner: memory and time models per rank, and the search over layouts."""
