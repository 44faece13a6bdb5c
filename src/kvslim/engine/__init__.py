"""The serving engine: Scheduler + BlockManager decide (plain Python), ModelRunner computes
(torch), Sequence carries a request's state between them."""
