"""One module per ``llm-operator bench <target>`` suite, and the stand-alone measurements."""
