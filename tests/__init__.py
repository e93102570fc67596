"""The test suite as a package, so pytest puts the checkout root on sys.path and the helpers import as
`tests.helpers.<name>` rather than as bare top-level names that any installed module could shadow."""
