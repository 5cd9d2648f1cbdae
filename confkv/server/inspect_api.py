"""The cache inspector: its page and the JSON behind it (records kept by `GenerateService`)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from confkv.server.request_body import CheckedRoute
from confkv.server.schemas import ErrorResponse, InspectionResponse

# Plain HTML, CSS and JS, no build step; beside the server's code, not in it.
PAGE = Path(__file__).resolve().parent / "web" / "inspect"

router = APIRouter(prefix="/inspect", tags=["Cache inspector"], route_class=CheckedRoute)
assets = StaticFiles(directory=PAGE, check_dir=False)


@router.get("", response_class=FileResponse)
async def page() -> FileResponse:
    """The inspector's web page: run a prompt and see what each layer kept, quantised and dropped."""
    if not (PAGE / "index.html").is_file():
        raise HTTPException(404, "the inspector's page is not installed with this server")
    return FileResponse(PAGE / "index.html")


@router.get("/requests/{request_id}", response_model=InspectionResponse, responses={404: {"model": ErrorResponse}})
def inspection(request_id: str, request: Request) -> dict:  # sync: decoding the tokens runs on a worker thread
    """The tier history of a request sent with `"inspect": true`, while it is among the newest kept."""
    service = request.app.state.service
    record = service.inspections.get(request_id)
    if record is None:
        message = f'no inspection for {request_id!r}: send the request with "inspect": true (the newest are kept)'
        raise HTTPException(404, message)
    return record.to_json(service.tokenizer)
