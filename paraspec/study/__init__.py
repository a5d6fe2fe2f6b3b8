"""Studies: measurements that explain a method rather than run it (EasySpec's hidden-state similarity and
ablations). Each study is a function returning plain rows, plus a `paraspec study ...` command."""
