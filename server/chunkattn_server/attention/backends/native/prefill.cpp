// chunkattn's native CPU prefill (placeholder while it is written: binds nothing yet).

#include "pages.h"

namespace chunkattn {

void bind_prefill(pybind11::module_& m) { (void)m; }

}  // namespace chunkattn
