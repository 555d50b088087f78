"""The benchmarks behind BENCHMARKS.md: each configuration measured in its own process, one JSON
row per configuration under OUT/rows/TABLE/, and the report rebuilt from all rows."""
