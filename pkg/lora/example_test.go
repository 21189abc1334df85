package lora_test

import (
	"fmt"
	"log"
	"os"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/lora"
)

// Check an adapter directory before handing it to a runtime.
func ExampleInspect() {
	dir, err := os.MkdirTemp("", "adapter-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := loratest.WriteAdapter(dir, loratest.AdapterSpec{Rank: 16, Modules: []string{"q_proj", "v_proj"}, Layers: 2, Base: "org/base"}); err != nil {
		log.Fatal(err)
	}
	a, err := lora.Inspect(dir)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(a.Rank, a.Alpha, a.TargetModules, a.BaseModel, a.Tensors)
	// Output: 16 32 [q_proj v_proj] org/base 8
}
