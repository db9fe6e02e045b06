"""make bench and make chaos: Tether under load and under faults, measured from the outside."""
