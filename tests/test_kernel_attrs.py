"""The C++ handlers' own checks on the release build (issue 32, "Memory safety").

Every case of tests/kernel_attrs.py, a direct ``jax.ffi.ffi_call`` of a registered target
past the Python checks: a malformed attribute (INT64_MAX, INT64_MIN, negative, a sum that
wraps int64, a block size or row count out of range) must be refused with an error naming
the attribute and its range, the operands unchanged; a call at the edge of a range must
run and leave every element outside its range as it was. tests/test_sanitizer.py drives
the same cases under AddressSanitizer and UBSan.
"""

import kernel_attrs
import pytest

from adamkit._cpu import load


def test_every_handler_checks_its_attributes_overflow_free(kernel):
  calls = kernel_attrs.calls()
  assert {c.target for c in calls} == set(load.TARGETS)  # every registered handler
  assert sum(c.error is None for c in calls) >= 5  # and valid calls at the ends of ranges
  for call in calls:
    kernel_attrs.check(call)


def test_a_wrong_expectation_fails(kernel):
  """The checker can fail: a valid call said to be refused, and a refused one said to be
  valid or refused for another reason."""
  calls = kernel_attrs.step_calls()
  valid = next(c for c in calls if c.error is None)
  refused = next(c for c in calls if c.error is not None)
  for wrong in (valid._replace(error="attribute offset"), refused._replace(error=None),
                refused._replace(error="attribute block")):
    with pytest.raises(AssertionError):
      kernel_attrs.check(wrong)
