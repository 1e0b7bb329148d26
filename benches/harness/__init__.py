"""The harness every bench runs on: timer, command line, configurations, result files."""
