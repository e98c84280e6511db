"""The protocol, Composer-free: sites, consensus and its transports, the attempt fence, the
collective ledger, the search policy, thrash detection, the dashboards' records.

May not touch: Composer (that is `automicro.composer`), private torch outside
`automicro.engine._torch_internals`, the test kit (`automicro.testing`).
"""
