"""What the gateway records about itself and the fleet: Prometheus metrics (`metrics`), the
P/D ratio advice (`ratio`) and its windows (`window`), the dashboard's request series (`series`).

Imports nothing else of the gateway's: every stage records here."""
