"""What every layer uses and none owns: typed errors, the state dir's paths, bounded YAML,
console and `-o json` output, `--env` parsing, config.yaml. Imports nothing else of gpuctl."""
