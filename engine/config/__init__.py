"""What a run is: the typed run configuration, YAML files with dotted overrides, the pre-flight checks and the check
that a checkpoint's weights fit the configured model."""
