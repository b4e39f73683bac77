"""Run configuration: the command line (parsing, defaults, validation) and the preflight checks run before Ray.

The components receive the parsed `args` namespace (as upstream slime's plugins do); they do not import this
package back, so configuration sits above them in the import graph.
"""
