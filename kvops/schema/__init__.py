"""What crosses a process boundary: the snapshot an engine serves, the reports it produces on demand,
and the diagnoses, audit entries and engine rows the supervisor serves. Each model is defined here once
and used by the side that writes it and the sides that read it; nothing here does I/O or imports torch."""
