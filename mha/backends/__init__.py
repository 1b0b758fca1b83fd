"""One module per framework, with the same public names in each.

Import a backend module directly (`mha.backends.torch`) or through `mha.load_backend`; this
package imports none of them by itself.
"""
