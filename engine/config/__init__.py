"""What a run is: the typed run configuration, YAML files with dotted overrides, and the pre-flight checks."""
